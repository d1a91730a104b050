"""Harness service: runs executions of tasks in sandboxes, with the built-in agent loop or an external harness, and grades them."""
