"""The daemon's state: models being loaded or resident, and the leases lent on them."""
