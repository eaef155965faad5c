"""The PyTorch implementation of the spec (issue: 'PyTorch implementation held to the spec').

Not written yet: nothing is registered with the harness, so `rosetta check` does not list a
torch backend until this package implements one."""
