"""What turns a mode name and its options into passes and a schedule: modes, composition, schedules."""
