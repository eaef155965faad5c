"""Versions of the spec and of the weights file format."""

SPEC_VERSION = "1.0"  # SPEC.md's version: bump the minor for additions, the major for changed semantics
FORMAT_NAME = "transformer-rosetta"  # metadata 'format' of a weights file
FORMAT_VERSION = 1  # metadata 'format_version'; readers refuse newer files
