"""What the test files share, and the only thing they import from each other: the
brute-force oracle (``oracle``), the case table and input factories (``cases``), the
topology table (``topologies``) and the backends under test (``backends``)."""
