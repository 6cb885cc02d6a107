//! Algorithms: pure schedules. (in progress)
