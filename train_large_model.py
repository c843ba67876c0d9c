#!/usr/bin/env python3
"""Seed-compatible entry point: `python train_large_model.py <flags>` == `tierlm train <flags>`."""

import sys

from tierlm.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
