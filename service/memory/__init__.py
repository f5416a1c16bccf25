"""Where processed weights live: arenas (one contiguous allocation per model and rank), their
handles on the wire, checksums, and the devices they sit on."""
