import sys

from kvfs.mount.daemon import main

sys.exit(main())
