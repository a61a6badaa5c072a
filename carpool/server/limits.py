"""Default bounds on what one server takes in; each is also a `carpool serve` flag."""

MAX_QUEUED_PER_TIER = 256  # requests waiting for their first token, per service tier
MAX_BODY_BYTES = 4 * 2**20
