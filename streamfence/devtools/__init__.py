"""Tools for trying and testing streamfence, never imported by the daemon's
own packages: the provider emulator (`emulator`), the demo (`demo`), a
daemon launcher for tests and scripts (`launcher`) and the demo's verdict
(`verdict`)."""
