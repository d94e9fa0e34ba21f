"""Looking at a running group: which channel each pair uses (``channels``), latency and
bandwidth per peer (``probe``), what can slow or break it (``doctor``), its traffic as the
monitor and panel show it (``traffic``), and what a remote value is (``values``).
"""
