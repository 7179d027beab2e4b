"""Load tests and benchmarks (serving client, scheduler placement); run as modules."""
