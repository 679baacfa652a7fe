import sys

from hetc.cli import main

sys.exit(main())
