"""Fixtures of the tests of dataset/: the shipped tokenizer."""

import pytest

from dataset import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)
