import sys
from pathlib import Path

# The shared kernel-test harness (`harness.py`) is imported by name from every test file here.
sys.path.insert(0, str(Path(__file__).parent))
