"""The labs (labs.py, the tool; test_lab_*.py, their tests; test_labs.py, the test of the labs), a
package so that pytest imports tests/labs/conftest.py as labs.conftest: as a second module named
conftest it would stand in for tests/conftest.py, whose helpers every test imports by that name."""
