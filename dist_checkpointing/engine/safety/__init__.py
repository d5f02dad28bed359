"""Loading checkpoint files without executing code stored in them."""
