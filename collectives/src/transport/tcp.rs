//! tcp transport (in progress)
