"""Storage backends, the item format, the writer workers and the reader."""
