"""Where a model's nodes are found and how a route is chosen among them: the signed advertisement and the route
planner (``routing.py``), every call to a tracker (``trackers.py``), and the lookup across trackers, the DHT and
peers' peers (``lookup.py``)."""
