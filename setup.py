"""distopt: one distribution, two import packages (distopt, functional); see setup.cfg."""
from setuptools import setup

setup()
