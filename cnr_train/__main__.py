"""``python -m cnr_train`` / ``torchrun -m cnr_train``: see :mod:`cnr_train.cli`."""

import sys

from cnr_train.cli import main

sys.exit(main())
