import sys

from dev.census.run import main

sys.exit(main())
