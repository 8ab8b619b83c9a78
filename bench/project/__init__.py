"""Projected hardware time from the benchmarks' side (docs/projection.md): capture pods of the
benchmarks' workloads (`bench.project.capture`), the trace synthesizer for pods this machine
cannot run (`bench.project.synth`), and the validation harness against the seeds' published
figures (`bench.project.validate`). The replay itself, which imports nothing of the pod, is
`runtime.project`."""
