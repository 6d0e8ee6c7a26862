import sys

from vgpu.cli.main import main

sys.exit(main())
