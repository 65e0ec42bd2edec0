import sys
import warnings

from .report import main

warnings.filterwarnings("ignore")  # the libraries' own deprecation notices
sys.exit(main())
