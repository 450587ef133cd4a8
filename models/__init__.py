"""Models as pytrees of plain arrays."""
