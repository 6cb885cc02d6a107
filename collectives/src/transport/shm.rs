//! shm transport (in progress)
