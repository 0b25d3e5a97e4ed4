"""``python -m ftrain`` (and ``torchrun -m ftrain``) is the ``ftrain`` command."""

import sys

from ftrain.app.cli import main

sys.exit(main())
