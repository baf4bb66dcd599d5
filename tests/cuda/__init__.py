"""The GPU tests, a module per concern, collected by tests/test_cuda.py (which runs them: the suite's
collection skips these modules, whose names are not test_*.py). pytest looks fixtures up where a
test is collected, tests/test_cuda.py: a fixture for them belongs in tests/conftest.py."""
