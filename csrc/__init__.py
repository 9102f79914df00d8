"""The C++ sources of the op's host layer, shipped as package data (native.py)."""
