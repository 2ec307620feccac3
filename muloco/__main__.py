import sys

from muloco.cli import main

sys.exit(main())
