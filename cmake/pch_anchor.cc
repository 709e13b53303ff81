// The anchor translation unit of a precompiled-header target (cmake/SimplerHelpers.cmake,
// SIMPLER_PCH): the targets of its kind reuse the header it precompiles.
