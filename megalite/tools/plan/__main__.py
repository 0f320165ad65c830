import sys

from megalite.tools.plan.cli import main

sys.exit(main())
