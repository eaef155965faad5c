"""The JAX/Flax NNX implementation of the spec (issue: 'JAX/Flax implementation held to the spec').

Not written yet: nothing is registered with the harness, so `rosetta check` does not list a
jax backend until this package implements one."""
