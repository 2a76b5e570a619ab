import sys
from pathlib import Path

# tests/helpers.py is importable as `helpers` from every test tier
sys.path.insert(0, str(Path(__file__).resolve().parent))
