"""Checks of the install rather than of a model: `hf-gradaccum env` (what was found) and `hf-gradaccum test` (whether
accumulation is exact on this device, in each precision it supports). Same code on CPU and on accelerators.

May import: `engine/`, `helpers/`, and the top-level `versions.py`.
"""
