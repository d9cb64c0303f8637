"""megatron-core's optimizer state, format-neutral: parameter order (``order``), flat buffers and their DP shards
(``flat``), data-parallel sizes (``data_parallel``), the grad scaler (``scaler``), the state a reader gives by
canonical parameter (``source``), whether and how a conversion carries it (``carry``), ``--dry-run``'s lines
(``plan``), the per-parameter export form (``export``). Where a format keeps the state is its loader's and saver's
(``pgconvert.loaders.<format>``, ``pgconvert.savers.<format>``), through the hooks of ``pgconvert.formats``."""
