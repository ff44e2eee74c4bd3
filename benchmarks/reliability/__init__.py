"""Reliability under faults, fuzzing and load: what a server does when files break, the disk
fills, the process is killed or stopped mid-work, or inputs and traffic are hostile."""
