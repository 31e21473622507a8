import os
import sys

# The tests share fsdp2_testlib.py (pytest runs with --import-mode=importlib).
sys.path.insert(0, os.path.dirname(__file__))
