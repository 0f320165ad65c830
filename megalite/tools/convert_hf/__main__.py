import sys

from megalite.tools.convert_hf.cli import main

sys.exit(main())
