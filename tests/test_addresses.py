"""Where a part listens by default, and the warning for one left on loopback (net/addresses.py); across machines:
tests/test_readme_recipes.py."""

from __future__ import annotations

from ggufswarm.net.addresses import is_loopback, listen_host_toward, loopback_warning, source_address


def test_loopback_names_and_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback(None)
    for spelled in ("127.1", "0x7f000001", "2130706433", "::ffff:127.0.0.1"):  # what a resolver reads as 127.0.0.1
        assert is_loopback(spelled), spelled


def test_a_part_told_only_of_this_machine_stays_on_loopback():
    assert listen_host_toward([]) is None and listen_host_toward([None, ""]) is None
    assert listen_host_toward(["http://127.0.0.1:8470", None, "localhost:6881"]) == "127.0.0.1"
    assert source_address("http://127.0.0.1:8470") == "127.0.0.1"
    assert source_address("http://:8470") is None


def test_the_warning_names_the_flag_and_the_other_machine():
    assert loopback_warning("ggufswarm node", "127.0.0.1", ["http://127.0.0.1:8470"]) is None
    assert loopback_warning("ggufswarm node", "10.0.0.2", ["http://10.0.0.1:8470"]) is None
    said = loopback_warning("ggufswarm node", "127.0.0.1", [None, "http://10.0.0.1:8470"], "--public-host")
    assert said.startswith("ggufswarm node: WARNING: --public-host 127.0.0.1 is loopback-only")
    assert "http://10.0.0.1:8470 is on another machine" in said and "--public-host ADDR" in said
