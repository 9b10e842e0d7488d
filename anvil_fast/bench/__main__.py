import sys

from anvil_fast.bench import main

sys.exit(main())
