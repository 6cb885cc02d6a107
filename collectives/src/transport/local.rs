//! local transport (in progress)
