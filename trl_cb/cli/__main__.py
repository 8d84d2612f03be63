"""`python -m trl_cb.cli` (what `accelerate launch --module trl_cb.cli` runs): the `trl-cb` command."""

import sys

from .command import main

sys.exit(main())
