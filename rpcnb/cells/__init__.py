"""Remote cells: run where they are sent (``runner``), their output captured there and
printed where they were asked for (``output``), and the caller's side that sends a cell,
streams its output and collects its result (``call``)."""
