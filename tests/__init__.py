"""The test suite: one folder per package of src/tierlm (tests/runtime for tierlm.runtime, ...);
the tests of the CLI, config and docs at the top. Packages (these __init__.py files), so that
two folders may hold test files of the same name and helpers import as tests.<module>."""
