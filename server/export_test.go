package server

// RetryableAccept exports retryableAccept to the tests.
var RetryableAccept = retryableAccept
