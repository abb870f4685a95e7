"""Stage functions: plain arguments in, files out. The CLI, the tests and the KFP components call these."""
