"""``python -m ggufswarm.cli``: the command line (``ggufswarm``)."""

import sys

from . import main

sys.exit(main())
