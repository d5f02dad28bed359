"""Scripts that tests run as real programs (``python script.py`` or ``torchrun``)."""
