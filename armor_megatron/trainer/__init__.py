"""The ARMOR training loop (Algorithm 1) and what it needs around it: logging, monitoring, signals."""
