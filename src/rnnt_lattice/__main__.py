"""``python -m rnnt_lattice`` runs the ``rnnt-lattice`` command."""
import sys

from .cli import main

sys.exit(main())
