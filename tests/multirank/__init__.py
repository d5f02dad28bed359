"""Multi-rank tests: real gloo process groups on 127.0.0.1 through tests.support.harness."""
