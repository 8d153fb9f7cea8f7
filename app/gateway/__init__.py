"""The inference gateway (`rackplane gateway`): its own stateless process in front of the
tenants' endpoints (issue 47 §2). `routes` keeps the table of ready replicas, `traffic`
counts what it sees for the autoscaler and Prometheus, `app` takes the requests."""
