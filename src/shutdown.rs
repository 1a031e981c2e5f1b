//! Every bound on how long a shutdown waits, in one place. A deployment's termination
//! grace period (Kubernetes `terminationGracePeriodSeconds`, `docker stop -t`) must
//! cover `dispatch.shutdown_grace_ms` (in-flight confirms, configurable) plus these.

use std::time::Duration;

/// Open HTTP requests get this long to finish (`http::serve`).
pub const HTTP_DRAIN: Duration = Duration::from_secs(5);

/// Each closing step with the broker (channel, connection) waits this long at most
/// (`amqp::close_quietly`).
pub const AMQP_CLOSE: Duration = Duration::from_secs(2);

/// The Redis-side tasks (requeue sweep, notifications, HTTP) get this long to stop
/// once the stages have (`app::run`).
pub const BACKGROUND_TASKS: Duration = Duration::from_secs(5);
